"""The eager path: what runs where no compiled sharc graph covers.

`module.weight` yields the full parameter (full_param_access.py); the eager
schedule decides when gathered parameters live, forward and backward
(schedule.py), gathering one group ahead from the previous pass's order
(prefetch.py). See docs/design/eager-schedule.md."""
