"""Serve one mixed batch of LoRA requests; see `lora_jax.serve` for the options.

python examples/serve.py                      # embedded tiny model + 3 adapters
python examples/serve.py --model DIR --adapter sql=DIR --prompt "SELECT" --tp 2
"""

import sys

from lora_jax.serve import main

if __name__ == "__main__":
    sys.exit(main())
