"""The Zoo page's "Your models" form: base, experts (dense directories, or LoRA adapters where
this featcal loads them), optionally a merged model of the user's own, and a data folder (image
folders, or a text / token file per task) become a zoo spec YAML, written, shown to keep, and
opened as the app's zoo, but only once the zoo loader has loaded it (what stops it is shown whole,
in the loader's words; a Llama-family base gets its ``featcal calibrate`` command instead). The spec is
:func:`featcal.zoo.spec.userspec.user_spec`'s."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from app import controls, state
from app.zoos import plain
from featcal.zoo.spec import userspec
from featcal.zoo.spec.schema import FEATURES


def default_folder() -> Path:
    from featcal.zoo.builtin.demo import cache_dir

    return cache_dir() / "zoos" / "yours"


def expert_paths(folder: str, lines: str, tasks: list[str] | None) -> dict[str, str]:
    """``{task: expert directory}``: ``<folder>/<task>`` for every task that has one (every
    sub-folder when ``tasks`` is None: no data read yet), then the ``task = path`` lines (which win)."""
    out = {}
    if folder.strip():
        root = Path(folder.strip()).expanduser()
        names = (
            tasks
            if tasks is not None
            else sorted(p.name for p in root.iterdir() if p.is_dir())
            if root.is_dir()
            else []
        )
        out = {t: str(root / t) for t in names if (root / t).exists()}
    for line in lines.splitlines():
        if line.strip():
            task, sep, path = line.partition("=")
            if not sep or not task.strip() or not path.strip():
                raise userspec.UserSpecError(f"expert line {line.strip()!r}: write it as task = /path/to/expert.")
            out[task.strip()] = path.strip()
    return out


def _spec(ss) -> tuple[dict, Path]:
    """The spec the form's fields make and the file it is to be written to (may be written: not
    someone else's file), or :class:`~featcal.zoo.spec.userspec.UserSpecError`. A generative language
    model's base is refused first, with its ``featcal calibrate`` command."""
    base = ss["yours_base"].strip()
    userspec.refuse_generative(base, expert_paths(ss["yours_experts"], ss["yours_lines"], None))
    data = userspec.find_tasks(ss["yours_data"])
    experts = expert_paths(ss["yours_experts"], ss["yours_lines"], list(data))
    heads = {"type": "file", "path": ss["yours_heads"].strip()} if ss["yours_heads"].strip() else None
    spec = userspec.user_spec(
        ss["yours_name"].strip(),
        base,
        experts,
        data,
        heads,
        ss["yours_format"],
        merged=ss["yours_merged"].strip() or None,
        features=ss["yours_features"],
        tokenizer=ss["yours_tokenizer"].strip() or None,
    )
    folder = Path(ss["yours_folder"].strip()).expanduser() if ss["yours_folder"].strip() else default_folder()
    return spec, userspec.check_writable(folder / f"{spec['name']}.yaml")


def _write() -> None:
    """Callback of the form's button (before the next run draws the sidebar's zoo picker, so
    it may set it): build the spec, load the zoo it makes with the zoo loader, and only then
    write it and open it; or keep the refusal (and the command to run instead) for the form."""
    ss = st.session_state
    for key in ("_yours_error", "_yours_command", "_yours_written"):
        ss.pop(key, None)
    try:
        spec, path = _spec(ss)
        zoo = userspec.load_checked(spec, path, state.device())  # one zoo load at a time, not beside the sidebar's
        text = userspec.spec_text(spec)
        path = userspec.write_spec(path, text)
    except (userspec.UserSpecError, OSError) as exc:
        ss["_yours_error"] = str(exc)
        ss["_yours_command"] = getattr(exc, "command", None)
        return
    state.hand_over(str(path), text, zoo)  # the picker opens it without loading it again
    ss["_yours_written"] = (str(path), text, *userspec.preset_of(zoo))
    ss[controls.OPEN_ZOO] = str(path)  # the sidebar's picker opens it on this rerun


FEATURES_HELP = (
    "What the heads read. embedding: the projected, normalised image embedding (zero-shot heads need it, and "
    "a base with a visual_projection: a CLIPModel directory). projection: projected only. pooled: the vision "
    "tower's pooled output, for a CLIPVisionModel base (no projection), with a heads file. Text zoos: embedding."
)


def _fields() -> None:
    """The form's inputs (their values are read by :func:`_write` from Session State)."""
    c1, c2, c3 = st.columns([2, 1, 1])
    c1.text_input("zoo name", "my-zoo", key="yours_name")
    c2.selectbox("format", ["hf", "open_clip"], key="yours_format")
    c3.selectbox("features", list(FEATURES), key="yours_features", help=FEATURES_HELP)
    st.text_input("base model directory", key="yours_base", placeholder="~/models/clip-vit-b32")
    st.text_input("data folder (one dataset per task)", key="yours_data", placeholder="~/data/my-tasks")
    st.text_input(
        "experts folder (one sub-folder per task, named as the datasets)",
        key="yours_experts",
        placeholder="~/models/experts",
    )
    st.text_area("or one expert per line: task = directory", key="yours_lines", height=80)
    st.text_input(
        "your merged model (optional: a save_pretrained directory, used instead of featcal's merge)",
        key="yours_merged",
        placeholder="~/models/mergekit-out",
    )
    st.text_input(
        "heads file (optional: safetensors of <task>.weight; default zero-shot from the base's text tower)",
        key="yours_heads",
    )
    st.text_input(
        "tokenizer directory (text data only, optional: default the base's own tokenizer files)",
        key="yours_tokenizer",
        placeholder="~/models/minilm",
    )
    st.text_input("save the YAML in (default: featcal's cache)", key="yours_folder", placeholder=str(default_folder()))


def form() -> None:
    """The form, then what it wrote (and the preset it will be calibrated with), or why it could
    not, whole (wrapped at any width), with the command to run instead where there is one."""
    written, error = st.session_state.get("_yours_written"), st.session_state.get("_yours_error")
    box = st.expander("**Your models** · a zoo of your own base, experts and data", expanded=bool(written or error))
    with box:
        lora = "are loaded" if userspec.lora_supported() else "are not supported yet in this version"
        st.markdown(
            f"""
- **Models**: a base and its task experts (`save_pretrained` directories; LoRA adapters {lora}),
  optionally your own merged model (e.g. a mergekit output), offered as the merger *your merged model*.
  Image zoos are CLIP (a `CLIPModel` base; a `CLIPVisionModel` base needs *features* `pooled` and a heads
  file); text zoos are encoders (BERT, MiniLM, ...). Llama-family and T5 models get the `featcal calibrate`
  command that calibrates them.
- **Data**, one dataset per task in one folder. Images: `<task>/train/<class>/<image>` and
  `<task>/test/<class>/<image>`, or `<task>.npz` of `train_inputs`, `train_labels`, `test_inputs`,
  `test_labels`. Text: `<task>.txt`, one `label<TAB>text` example per line (tokenised with the base's
  tokenizer, or the *tokenizer directory*'s; a fifth is test), or tokens: `<task>.npz` / `.safetensors` of
  `train_input_ids`, `train_labels`, `test_input_ids`, `test_labels` (optional `*_attention_mask`).
- The app loads the zoo first, as it will open it: only a zoo that loads is written (the YAML, documented
  in docs/zoos.md) and opened, with the preset picked from its architecture.
"""
        )
        with st.form("yours"):
            _fields()
            st.form_submit_button("Write the zoo YAML and open it", type="primary", on_click=_write)
        if error:
            st.error(plain(error), icon=":material/error:")
            if st.session_state.get("_yours_command"):
                st.code(st.session_state["_yours_command"], language="bash", wrap_lines=True)
        if written:
            path, text, preset, why = written
            st.success(
                f"Wrote `{path}` and opened it (sidebar: other path). Preset **{preset}** ({plain(why)}): "
                "the Calibrate page starts from it.",
                icon=":material/check_circle:",
            )
            st.code(text, language="yaml")
            st.download_button("zoo.yaml", text, Path(path).name, "application/yaml", key="yours_dl", on_click="ignore")
