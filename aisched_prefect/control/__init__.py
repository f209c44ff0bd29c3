"""The control plane: the process that holds authority outside the flow process.

Admission, approvals, budgets (through the ledger) and dispatch to the Dask
cluster run here, behind the credential each flow run presents; nothing a flow
imports or sets in its environment can change what this process reads. Start it
with `aisched serve`;
flows reach it through `aisched_prefect.flow.client`.
"""
