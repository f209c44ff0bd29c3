"""The flow side: what runs in a flow's own process, untrusted where authority is concerned.

The task runner (`runner`), `@ai_task` (`task`), the flow run's session with the control plane (`session`, `stream`,
`client`), large results fetched from their worker (`direct`), the Prefect context an AI task's run sees
(`taskcontext`), the runner's settings (`config`) and the control plane a flow starts for itself when none is
configured (`embedded`). Nothing here grants, limits or records: the control plane (`aisched_prefect.control`,
`aisched_prefect.ledger`) does, in its own process. The public names are in `aisched_prefect`.
"""
