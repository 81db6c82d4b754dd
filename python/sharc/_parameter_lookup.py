"""`Module.get_parameter(name)` on a sharded model.

[Note: get_parameter gives the shard]
`model.named_parameters()` yields each sharded parameter's flat shard under
its original name, while `module.weight` yields the gathered copy (a plain
tensor, see eager/full_param_access.py). torch's `get_parameter` reads the
attribute and refuses anything that is not an `nn.Parameter`, so on a
sharded model it failed with "`weight` is not an nn.Parameter", and code
built on it (transformers' `tie_weights()` and `get_parameter_or_buffer`)
with less clear errors. `import sharc` wraps it once per process: a name
that a sharded module holds gives the registered shard, the same object
`named_parameters()` gives under that name; every other name goes to
torch's function as it is.
"""

from __future__ import annotations

import functools

import torch

from sharc._state import state_of


def install() -> None:
    torch_get = torch.nn.Module.get_parameter
    if getattr(torch_get, "_sharc_wraps", None) is not None:
        return  # installed already

    @functools.wraps(torch_get)
    def get_parameter(self: torch.nn.Module, target: str) -> torch.nn.Parameter:
        module_path, _, name = target.rpartition(".")
        module = self.get_submodule(module_path)
        state = state_of(module)
        if state is not None and name in state.refs:
            return module._parameters[name]
        return torch_get(self, target)

    get_parameter._sharc_wraps = torch_get
    torch.nn.Module.get_parameter = get_parameter
