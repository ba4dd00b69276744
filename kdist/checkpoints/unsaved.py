"""What Keras' `save_weights` leaves out or changes, kept in a checkpoint beside it.

Two groups of datasets, one per variable in the order of `model.variables`:

- `kdist_seed_generators`: the state of every `keras.random.SeedGenerator` of
  the model (Dropout's, and any layer's that draws random numbers).
  `save_weights` leaves them out (they are not weights), so without them a
  resumed run would draw the dropout masks of its first steps again instead
  of those the uninterrupted run draws next.
- `kdist_lora`: every variable of each layer with LoRA enabled
  (`layer.enable_lora(rank)`), as it is. `save_weights` writes such a
  layer's kernel with its LoRA factors merged in, and `load_weights` sets the
  factors to zero, where each one's gradient is zero while the other is: a
  run resumed from it would no longer train them. These datasets put the
  layer back as it was.

Keras' own `load_weights` ignores both groups: a model without LoRA layers
reads the merged kernel, as from a file Keras wrote (kdist's `restore`
refuses it: its weights differ). A file without a group holds none of them:
a model that has some is another model.
"""

import numpy as np

from kdist.errors import InvalidCheckpoint

SEED_GROUP = "kdist_seed_generators"
LORA_GROUP = "kdist_lora"


def seed_states(model):
    """The state variables of the model's `keras.random.SeedGenerator`s, in order."""
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


def lora_variables(model):
    """The variables of the model's layers with LoRA enabled, in `model.variables`' order."""
    own = {id(v) for layer in model._flatten_layers()
           if getattr(layer, "lora_enabled", False) for v in layer.variables}
    return [v for v in model.variables if id(v) in own]


# (group, the model's variables it holds, what a count of them is called).
_GROUPS = ((SEED_GROUP, seed_states, "the state of {} random seed generator(s)"),
           (LORA_GROUP, lora_variables, "{} variables of layers with LoRA enabled"))


def write(model, f):
    """Adds the groups of `model`'s variables to open HDF5 file `f`."""
    for name, variables_of, _ in _GROUPS:
        variables = variables_of(model)
        if variables:
            group = f.create_group(name)
            for i, variable in enumerate(variables):
                group[str(i)] = np.array(variable.numpy())


def read(model, f):
    """Assigns `model`'s variables from the groups of open HDF5 file `f`. Raises
    InvalidCheckpoint if a group holds another count of variables than the
    model has."""
    for name, variables_of, what in _GROUPS:
        variables = variables_of(model)
        held = len(f[name]) if name in f else 0  # `write` leaves out an empty group.
        if held != len(variables):
            raise InvalidCheckpoint(f"it holds {what.format(held)}; the model has "
                                    f"{len(variables)}")
        if not held:
            continue
        group = f[name]
        for i, variable in enumerate(variables):
            variable.assign(group[str(i)][()].astype(variable.dtype))
