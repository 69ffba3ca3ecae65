"""``streamlit run`` with the demo zoo's recipe swapped for a micro one (for the browser tests):
no shipped copy or cache matches it, so the first page builds the zoo, in seconds, with the
progress the app shows for any build. Usage: ``python micro_demo_server.py run app.py ...``."""

from __future__ import annotations

import sys

from featcal.zoo import demo

MICRO = demo.Recipe(
    tasks=("colour", "position"),
    n_train=96,
    n_calib=32,
    n_val=16,
    n_test=24,
    n_pretrain=32,
    pretrain_steps=600,  # a few seconds of steps, so the page shows several progress updates
    finetune_steps=60,
    batch_size=8,
    vision=dict(
        image_size=32, patch_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    ),
)

if __name__ == "__main__":
    demo.Recipe = lambda: MICRO  # what demo.py calls for "the current recipe"
    from streamlit.web import cli

    sys.argv = ["streamlit", *sys.argv[1:]]
    sys.exit(cli.main())
