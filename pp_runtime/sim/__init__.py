"""Cluster-scale simulator: the project's own scheduler and engine loop, workers replaced by a cost
model, time simulated (DESIGN.md §2 ``sim/``). Plain Python + numpy: no torch, no Ray.

    from pp_runtime.sim import run_simulation
    comparison = run_simulation("configs/sim/fig12.yaml", "runs/fig12")

Pieces, usable on their own:
  presets        Hardware / SimModel presets (configs/sim/hardware.yaml, models.yaml)
  batch_shape    BatchShape: what a micro-batch's cost depends on; OPS, the per-layer ops timed
  roofline_cost  RooflineCostModel: per-layer op times from a Hardware preset
  profile_fit    read_profile, fit_profile → ProfileFit: per-op lines fitted to a profile.csv
  profile_cost   ProfileCostModel (one profile), StageProfiles (one per stage)
  stage_cost     PipelineCost (per-layer model → stage and send times), ConstantCost
  memory         plan_memory: the paper's B = ⌊(M_G − M_S)/(L·m_kv)⌋ and the KV block count per deployment
  executor       SimExecutor: the Executor interface of pp_runtime.engine.Engine on a virtual clock
  simulator      simulate(): R replicas × real Engine/Scheduler/BlockManager + SimExecutor, event-ordered
  rundir         write_sim_run_dir: the bench run-directory format
  scenario       Scenario (one deployment to simulate), SimConfig (its model, hardware, workload, scenarios)
  config         load_sim_config: configs/sim/*.yaml → SimConfig
  deployment     plan_deployment: a scenario's memory plan, SchedulerConfig, costs and GPU placement
  comparison     comparison / format_report: finished scenarios → comparison.json, <name>.md
  run            run_simulation / run_scenario: scenarios → run dirs, comparison.json, <name>.md
"""
from pp_runtime.sim.batch_shape import OPS, BatchShape
from pp_runtime.sim.config import load_sim_config, parse_sim_config
from pp_runtime.sim.deployment import plan_deployment
from pp_runtime.sim.executor import PlanInfo, SimExecutor, VirtualClock
from pp_runtime.sim.memory import SimMemoryPlan, plan_memory
from pp_runtime.sim.presets import (Hardware, SimModel, hardware_names, hardware_preset, model_names, model_preset,
                                    resolve_hardware, resolve_model)
from pp_runtime.sim.profile_cost import ProfileCostModel, StageProfiles
from pp_runtime.sim.profile_fit import ProfileFit, fit_profile, read_profile
from pp_runtime.sim.roofline_cost import RooflineCostModel
from pp_runtime.sim.rundir import write_sim_run_dir
from pp_runtime.sim.run import run_scenario, run_simulation, workload_items
from pp_runtime.sim.scenario import Scenario, SimConfig
from pp_runtime.sim.simulator import DummyTokens, SimReplica, SimResult, simulate
from pp_runtime.sim.stage_cost import ConstantCost, PipelineCost

__all__ = ["run_simulation", "run_scenario", "plan_deployment", "workload_items", "load_sim_config",
           "parse_sim_config", "SimConfig", "Scenario", "simulate", "SimResult", "SimReplica", "DummyTokens",
           "SimExecutor", "VirtualClock", "PlanInfo", "BatchShape", "RooflineCostModel", "ProfileCostModel",
           "ProfileFit", "StageProfiles", "fit_profile", "read_profile", "PipelineCost", "ConstantCost", "OPS",
           "plan_memory", "SimMemoryPlan", "Hardware", "SimModel", "hardware_preset", "model_preset", "hardware_names",
           "model_names", "resolve_hardware", "resolve_model", "write_sim_run_dir"]
