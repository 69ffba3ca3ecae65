"""``streamlit run`` with the demo zoo's recipe swapped for a micro one (for the browser tests):
no shipped copy or cache matches it, so the first page builds the zoo, in seconds, with the
progress the app shows for any build. Usage: ``python micro_demo_server.py run app.py ...``."""

from __future__ import annotations

import sys

from featcal.zoo.builtin import demo, demo_recipe

# a few seconds of steps, so the page shows several progress updates
MICRO = demo_recipe.micro_recipe(pretrain_steps=600, finetune_steps=60)

if __name__ == "__main__":
    demo.Recipe = lambda: MICRO  # what demo.py calls for "the current recipe"
    from streamlit.web import cli

    sys.argv = ["streamlit", *sys.argv[1:]]
    sys.exit(cli.main())
