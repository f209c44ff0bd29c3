"""The queue's scheduling policies, one module each, and what they share.

- `interface`: what a policy is given and answers (`Job`, `Start`, `Running`, `ClusterState`, `Preemption`) and
  the `Policy` interface every policy implements;
- `placement`: where a job fits now, EASY's reservation, backfill placement, gangs on whole hosts, max-min shares,
  reclaim (the preemptions that give quotas back) and `NoRoom` (a pass's shortcut past runs that cannot fit);
- `fifo`: `Fifo` and `EasyBackfill` (the base of every policy with a reservation);
- `fair_share`: `FairShare` (the previous default);
- `fairness_books`: the finish-time fairness accounting `FinishTimeFair` keeps (rho per tenant);
- `estimates`: each tenant's estimates corrected from its own history (what `FinishTimeFair` plans on);
- `starvation`: the starvation bound (`starve_after`): a light tenant's oldest run, once it waited that long, first
  and on a reservation;
- `finish_time_fair`: `FinishTimeFair`, the live queue's default;
- `config`: `PolicyConfig`, the one configuration the live plugin and the simulator build it from.

The simulator's baselines (`PlainDask`, `SjfEasy`, `Las2D`, `MaxMinFair`) live beside the simulator
(`dask_gpu.sim.baselines`); `dask_gpu.sim.policies` names them all in one place.
"""
