"""The reliability and security suite (`make chaos`): scenarios that push the server
with hostile input and hostile clients, each ending with the invariants (nothing left
running, nothing leaked, the ledger exact). Each runs short under `make test` and long
under `make chaos`, which also renders docs/reliability.md from what they `record`."""
