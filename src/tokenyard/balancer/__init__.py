"""Stage 12: choosing a replica of a deployment and talking to it over HTTP: engine
replicas (`replica_client`, `generation`), OpenAI-compatible upstreams (`upstream`,
`upstream_generation`) and embeddings replicas (`embeddings_client`), each deployment's
replicas behind one `pool.Pool` (never imports torch)."""
