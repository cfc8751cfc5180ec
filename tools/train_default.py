"""Train the built-in default model: a small LLaDA2-architecture MoE diffusion LM.

The command line of `oled.train` (data, objective and training loop there; docs/default-model.md
and docs/routing-twin.md describe them); `--preset twin` trains the routing twin.

    # the shipped checkpoint's recipe: one GPU (an H200), 7.5 minutes of training
    python tools/train_default.py --device cuda --minutes 7.5 --batch 64 --blocks 8 \
        --eval-every 100 --out runs/default-gpu
    # smaller CPU run
    python tools/train_default.py --device cpu --threads 1 --minutes 40 --out runs/default-cpu
"""

from __future__ import annotations

from oled.train import main

if __name__ == "__main__":
    main()
