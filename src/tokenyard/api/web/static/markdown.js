// A small markdown renderer for model replies that cannot produce markup from the text.
//
// The text is never parsed as HTML: every piece of it reaches the page as a text node
// (document.createTextNode escapes by construction), and the only elements are the ones
// built here — paragraphs, headings, fenced code blocks, lists, inline code, bold,
// italics, and links whose URL parses as http or https (anything else stays plain text).
// A fence still open at the end (a reply mid-stream) renders as code to the end.

const FENCE = /^\s*```\s*([\w+-]*)\s*$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d{1,9}[.)]\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
// Leftmost match wins; at one position code comes first, then bold before italics.
const INLINE = /`([^`\n]+)`|\*\*(\S(?:[^*\n]*\S)?)\*\*|__(\S(?:[^_\n]*\S)?)__|\*(\S(?:[^*\n]*\S)?)\*|(?<![\w])_(\S(?:[^_\n]*\S)?)_(?![\w])|\[([^\]\n]+)\]\(([^)\s]+)\)/;

function safeUrl(href) {
  try {
    const url = new URL(href);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

// Inline markup of one line of text, appended to `parent`.
function inline(parent, text) {
  while (text) {
    const m = INLINE.exec(text);
    if (!m) {
      parent.append(document.createTextNode(text));
      return;
    }
    if (m.index > 0) parent.append(document.createTextNode(text.slice(0, m.index)));
    const [whole, code, bold1, bold2, ital1, ital2, label, href] = m;
    if (code !== undefined) {
      const node = document.createElement("code");
      node.textContent = code;
      parent.append(node);
    } else if (bold1 !== undefined || bold2 !== undefined) {
      const node = document.createElement("strong");
      inline(node, bold1 ?? bold2);
      parent.append(node);
    } else if (ital1 !== undefined || ital2 !== undefined) {
      const node = document.createElement("em");
      inline(node, ital1 ?? ital2);
      parent.append(node);
    } else {
      const url = safeUrl(href);
      if (url === null) {
        parent.append(document.createTextNode(whole));
      } else {
        const node = document.createElement("a");
        node.href = url;
        node.target = "_blank";
        node.rel = "noopener noreferrer nofollow";
        inline(node, label);
        parent.append(node);
      }
    }
    text = text.slice(m.index + whole.length);
  }
}

// Lines joined by line breaks, each with its inline markup.
function lines(parent, texts) {
  texts.forEach((line, i) => {
    if (i > 0) parent.append(document.createElement("br"));
    inline(parent, line);
  });
}

// `text` rendered into a fresh DocumentFragment.
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const all = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < all.length) {
    const line = all[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const body = [];
      i += 1;
      while (i < all.length && !FENCE.test(all[i])) body.push(all[i++]);
      i += 1; // the closing fence (or past the end)
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      if (fence[1]) code.dataset.lang = fence[1];
      code.textContent = body.join("\n");
      pre.append(code);
      out.append(pre);
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      // Replies sit inside the page: their headings stay below the page's own.
      const node = document.createElement(`h${Math.min(6, heading[1].length + 2)}`);
      inline(node, heading[2]);
      out.append(node);
      i += 1;
      continue;
    }
    const listKind = BULLET.test(line) ? BULLET : NUMBERED.test(line) ? NUMBERED : null;
    if (listKind) {
      const list = document.createElement(listKind === BULLET ? "ul" : "ol");
      while (i < all.length && listKind.test(all[i])) {
        const item = document.createElement("li");
        inline(item, listKind.exec(all[i])[1]);
        list.append(item);
        i += 1;
      }
      out.append(list);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const para = [];
    while (i < all.length && all[i].trim() && !FENCE.test(all[i]) && !HEADING.test(all[i])
      && !BULLET.test(all[i]) && !NUMBERED.test(all[i])) {
      para.push(all[i++]);
    }
    const p = document.createElement("p");
    lines(p, para);
    out.append(p);
  }
  return out;
}
