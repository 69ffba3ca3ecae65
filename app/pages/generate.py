"""Generate page (LLM zoos): one prompt answered by the merged model, the calibrated model and
every expert, side by side (greedy decoding, the tokenizer's chat template)."""

import streamlit as st

from app import controls, state, ui, zoos
from app.settings import ModelRef

zoo, source = state.active_zoo(), state.active_source()
st.title("Generate")
if not hasattr(zoo, "generate"):
    st.info(
        "The generate box answers prompts with a language model: pick an LLM zoo (`smollm2`) in the sidebar.",
        icon=":material/info:",
    )
    st.stop()

fp = state.fingerprint(source)
merger = controls.current_merger()
cal = controls.current_calibration(zoos.split_size(zoo, "calib"))
st.caption(
    f"Greedy replies of **{merger.label}**, of it + exact FeatCal **{cal.label}** and of each expert "
    "(change the merge and the calibration on the Zoo and Calibrate pages)."
)
examples = {t: zoo.examples[t]["test"][0].prompt for t in zoo.tasks}
pick = st.selectbox("start from a test prompt", ["(my own)", *examples], key="gen_example")
prompt = st.text_area(
    "prompt", examples.get(pick, "What is the capital of France?"), key=f"gen_prompt_{pick}", height=110
)
max_new = st.slider("new tokens at most", 8, 128, 48, step=8, key="gen_tokens")
if not st.button("Generate", type="primary", key="gen_go") or not prompt.strip():
    st.stop()

replies = {}
with ui.status("Generating…") as s:
    with state.model_of(source, fp, ModelRef.merged(merger), hooks=False) as model:
        replies[f"merged ({merger.label})"] = zoo.generate(model, [prompt], max_new)[0]
    s.update(label=f"Running exact FeatCal: {cal.label}…")
    state.calibrated(source, fp, merger, cal)
    with state.model_of(source, fp, ModelRef.calibrated(merger, cal), hooks=False) as model:
        replies[f"calibrated ({cal.label})"] = zoo.generate(model, [prompt], max_new)[0]
    for task, expert in zoo.experts.items():
        s.update(label=f"Generating with the {task} expert…")
        with state.model_of(source, fp, ModelRef.base_model(), hooks=False):  # the main lock: experts are shared
            replies[f"expert {task}"] = zoo.generate(expert, [prompt], max_new)[0]
    s.update(label="Replies ready", state="complete")

for row in range(0, len(replies), 3):
    cols = st.columns(3)
    for col, (name, text) in zip(cols, list(replies.items())[row : row + 3]):
        with col:
            st.markdown(f"**{name}**")
            st.text(text or "(empty reply)")
