# Vendored from THUDM/slime (see benchmarks/peers/slime/README.md). CUT: upstream's body (the accelerator
# initialisation, a deep_ep/torch_memory_saver patch, `from . import megatron_patch`): GPU runtime patches
# for training, none of them on tools/convert_torch_dist_to_hf.py's path.
