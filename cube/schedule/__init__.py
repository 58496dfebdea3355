"""Pipeline schedules: which forward and backward micro-steps each rank runs, in order."""
from cube.schedule.schedules import (Action, Schedule, custom, sched_1f1b, sched_1f1b_interleaved, sched_gpipe,
                                validate)

__all__ = ["Action", "Schedule", "custom", "sched_1f1b", "sched_1f1b_interleaved", "sched_gpipe", "validate"]
