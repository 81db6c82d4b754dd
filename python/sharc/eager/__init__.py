"""The eager path: what runs where no compiled sharc graph covers.

`module.weight` yields the full parameter (full_param_access.py); the eager
schedule's hooks report module, read, saved-tensor and unit events to the
runtime, which decides when gathered parameters live, forward and backward,
what to gather ahead and how gradients are reduced (schedule.py; the
runtime's EagerScope, EagerPrefetch, EagerReduction). See
docs/design/eager-schedule.md."""
