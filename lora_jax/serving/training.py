"""Training adapters in device slots, beside the ones being served.

The LoRA stacks are `nnx.LoRAParam`s and every op has a gradient on every backend, so an
adapter can be trained in a slot of a wrapped model while the other slots keep serving:

1. `init_lora_slot` writes a fresh adapter into one slot, as PEFT initialises one:
   linear layers, the lm_head and MoE experts get A kaiming-uniform (`U(±1/sqrt(in))`)
   and B zero, the token embedding A zero and B standard normal, so the model starts
   out as the base model for that slot's tokens;
2. `nnx.Optimizer(model, optax.chain(tie_kv_replicas(model), opt, train_only_slots([slot])),
   wrt=nnx.LoRAParam)` updates that slot only: the other slots' adapters, even under
   weight decay, and every rank column past the slot's rank stay as they were;
   `tie_kv_replicas` (the identity unless tp > kv heads) trains the B rows that the
   stacks hold once per kv-head replica as the one parameter the adapter has. On a mesh,
   build the optimizer under ``jax.set_mesh(mesh)``: optax's and `nnx.Optimizer`'s step
   counts are then made on the mesh, where the first step leaves them, and the jitted
   step compiles once rather than again at the second step;
   A DoRA slot (`init_lora_slot(..., use_dora=True)`) trains its magnitudes with the
   factors; call `refresh_dora_norms(model, [slot])` after each `opt.update` so that the
   next forward divides by the norm of the updated weights, as PEFT's does
   (`lora_jax.serving.training_dora`);
3. `lora_jax.serving.export.save_peft_adapter` writes the slot as a PEFT adapter
   directory that PEFT, vLLM and `load_peft_adapter` load.

The stacks hold B with the scaling folded in (`alpha / r` is 1 for a slot made here), so
the exported adapter says `lora_alpha = r`. Beside a manager serving the same model, first
`manager.reserve_slot(slot)` a slot it holds no adapter in: the manager then never
activates an adapter into it (nor counts it free) until `manager.release_slot(slot)`.
`init_lora_slot` refuses a slot in which a live manager of the model holds an adapter
(whose requests would get the new weights); it cannot see an unreserved free slot being
taken later, hence the reservation.
`train_slots(optax.adamw(...), [slot])` does what the chain of step 2 does with the
optimizer's state (Adam: two copies of the stacks) and work sized to the trained slot
alone; `optax.chain(opt, train_only_slots([slot]))` keeps them for every slot. A large
model still trains best in a copy with few slots (`max_loras=1`), whose saved adapter the
serving model then loads.
The ops have their own backward pass (`lora_jax.ops_grad`): on a GPU through the kernels,
and where the caller says every mapped token uses one slot (`lj.lora_mapping(model,
slots, single_slot=True)`) dense matmuls against that slot's weights on every backend.
`benchmarks/train_step.py` (an H100, 4 Llama-3-8B layers, 4096 tokens, 8 slots, rank 64)
measured a step at 51.3 ms with XLA's VJP behind the
kernels, 38.8 ms through the kernels' backward, 37.0 ms with ``single_slot``
(benchmarks/RESULTS.md, "training", session 53).
A functional loop (`nnx.split`, plain `jax.grad`) sets the token mapping before the split:
Flax refuses to change a Variable (the mapping) inside `jax.grad`; `nnx.grad` /
`nnx.value_and_grad`, as above, take `lj.lora_mapping` inside.
"""

# The slot initialisation lives in `training_slots`, the optax transforms in
# `training_optax`; every name stays importable from here.
from lora_jax.serving.training_dora import refresh_dora_norms as refresh_dora_norms
from lora_jax.serving.training_optax import _kv_replica_ties as _kv_replica_ties
from lora_jax.serving.training_optax import _path_key as _path_key
from lora_jax.serving.training_optax import _tie_rows as _tie_rows
from lora_jax.serving.training_optax import tie_kv_replicas as tie_kv_replicas
from lora_jax.serving.training_optax import train_only_slots as train_only_slots
from lora_jax.serving.training_optax import train_slots as train_slots
from lora_jax.serving.training_slots import WHOLE_LAYERS as WHOLE_LAYERS
from lora_jax.serving.training_slots import _check_targets as _check_targets
from lora_jax.serving.training_slots import _target_names as _target_names
from lora_jax.serving.training_slots import _whole_init as _whole_init
from lora_jax.serving.training_slots import init_lora_slot as init_lora_slot
from lora_jax.serving.training_slots import is_linear as is_linear
from lora_jax.serving.training_slots import trainable_layers as trainable_layers
