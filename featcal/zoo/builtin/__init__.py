"""The built-in zoos' recipes, built offline from installed packages on first use: the demo zoos
(:mod:`.demo`, :mod:`.demo_recipe`, :mod:`.demo_data`, :mod:`.fashion`), the real text zoo
(:mod:`.realtext`, :mod:`.text_data`) and the LLM zoo (:mod:`.smollm2`, :mod:`.llm_tasks`)."""
