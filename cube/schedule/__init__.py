"""Pipeline schedules: which forward, backward (and weight-gradient) micro-steps each rank runs, in order."""
from cube.schedule.schedules import (Action, Schedule, custom, sched_1f1b, sched_1f1b_interleaved, sched_gpipe,
                                sched_dualpipev, sched_zb_h1, sched_zbv, v_placement, validate)

__all__ = ["Action", "Schedule", "custom", "sched_1f1b", "sched_1f1b_interleaved", "sched_dualpipev", "sched_gpipe", "sched_zb_h1", "sched_zbv", "v_placement", "validate"]
