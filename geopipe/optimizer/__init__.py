"""The plan optimizer: everything that decides a plan, and nothing that runs one.

Given a validated cluster spec it searches the plan — pipelines, stages per site, layer
partition, micro-batch, sequence length, ΔN and codec per WAN boundary — that trains
fastest within memory, by predicting each candidate with one cost model:

* :mod:`.shapes` — site order, candidate shapes, layer partition, the one Plan builder;
* :mod:`.costs`, :mod:`.memory` — activation/message sizes, per-device memory and the
  feasibility rule;
* :mod:`.simulator` — replays a schedule's action lists over the links;
* :mod:`.pipecosts` — one plan's seconds per action and WAN bytes (what the simulator replays);
* :mod:`.evaluate` — candidate -> plan -> simulated time, memory, feasibility (the fitness);
* :mod:`.genetic`, :mod:`.planner` — the DEAP search and ``geopipe plan``'s front;
* :mod:`.refine` — ΔN re-chosen from measured stage times;
* :mod:`.ladder`, :mod:`.templates`, :mod:`.instantiate` — pipeline templates for recovery
  (layout predictions and the ΔN ladder, best uniform layout, heterogeneous instantiation);
* :mod:`.policies` — the recovery and grow-back decisions the runtime executes;
* :mod:`.strategy`, :mod:`.outer_cost`, :mod:`.penalty` — the pipeline across the sites or
  replica groups joined by an outer loop (and hybrids): groupings, the price of a round,
  the measured loss penalty, the choice.

Pure: no Ray, no DeepSpeed, no torch (enforced by ``lint-imports``, see pyproject.toml).
"""
