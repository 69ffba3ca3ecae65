"""The Zoo page's "Your models" form: base, experts (dense directories, or LoRA adapters where
this featcal loads them), optionally a merged model of the user's own, and a data folder (image
folders, or a text / token file per task) become a zoo spec YAML, written, shown to keep, and
opened as the app's zoo. The spec is :func:`featcal.zoo.userspec.user_spec`'s."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from app import controls
from featcal.zoo import userspec


def default_folder() -> Path:
    from featcal.zoo.demo import cache_dir

    return cache_dir() / "zoos" / "yours"


def expert_paths(folder: str, lines: str, tasks: list[str]) -> dict[str, str]:
    """``{task: expert directory}``: ``<folder>/<task>`` for every task that has one, then the
    ``task = path`` lines (which win)."""
    out = {}
    if folder.strip():
        root = Path(folder.strip()).expanduser()
        out = {t: str(root / t) for t in tasks if (root / t).exists()}
    for line in lines.splitlines():
        if line.strip():
            task, sep, path = line.partition("=")
            if not sep or not task.strip() or not path.strip():
                raise userspec.UserSpecError(f"expert line {line.strip()!r}: write it as task = /path/to/expert.")
            out[task.strip()] = path.strip()
    return out


def _write() -> None:
    """Callback of the form's button (before the next run draws the sidebar's zoo picker, so
    it may set it): write the spec and open it, or keep the error for the form to show."""
    ss = st.session_state
    ss.pop("_yours_error", None)
    try:
        data = userspec.find_tasks(ss["yours_data"])
        experts = expert_paths(ss["yours_experts"], ss["yours_lines"], list(data))
        heads = {"type": "file", "path": ss["yours_heads"].strip()} if ss["yours_heads"].strip() else None
        spec = userspec.user_spec(
            ss["yours_name"].strip(),
            ss["yours_base"].strip(),
            experts,
            data,
            heads,
            ss["yours_format"],
            merged=ss["yours_merged"].strip() or None,
        )
        text = userspec.spec_text(spec)
        folder = Path(ss["yours_folder"].strip()).expanduser() if ss["yours_folder"].strip() else default_folder()
        path = userspec.write_spec(folder / f"{spec['name']}.yaml", text)
    except (userspec.UserSpecError, OSError) as exc:
        ss["_yours_error"] = str(exc)
        return
    ss["_yours_written"] = (str(path), text)
    ss[controls.OPEN_ZOO] = str(path)  # the sidebar's picker opens it on this rerun


def form() -> None:
    """The form, then what it wrote (or why it could not)."""
    written = st.session_state.get("_yours_written")
    box = st.expander("**Your models** · a zoo of your own base, experts and data", expanded=bool(written))
    with box:
        st.caption(
            "A base model and its task experts (`save_pretrained` directories; LoRA adapters "
            + ("are loaded" if userspec.lora_supported() else "are not supported yet in this version")
            + "), optionally your own merged model (e.g. a mergekit output: the merger *your merged model*), "
            "and a data folder with one dataset per task: images as `<task>/train/<class>/<image>` and "
            "`<task>/test/<class>/<image>`, or `<task>.npz` of `train_inputs`, `train_labels`, `test_inputs`, "
            "`test_labels`; text as `<task>.txt`, one `label<TAB>text` example per line (tokenised with the "
            "base's tokenizer; a fifth is test), or tokens as `<task>.npz` / `.safetensors` of "
            "`train_input_ids`, `train_labels`, `test_input_ids`, `test_labels` (optional `*_attention_mask`). "
            "Text makes a text zoo: the base is an encoder (BERT, MiniLM, ...). The app writes the zoo spec "
            "(YAML, documented in docs/zoos.md) and opens it."
        )
        with st.form("yours"):
            c1, c2 = st.columns([3, 1])
            c1.text_input("zoo name", "my-zoo", key="yours_name")
            c2.selectbox("format", ["hf", "open_clip"], key="yours_format")
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
                "save the YAML in (default: featcal's cache)", key="yours_folder", placeholder=str(default_folder())
            )
            st.form_submit_button("Write the zoo YAML and open it", type="primary", on_click=_write)
        if st.session_state.get("_yours_error"):
            st.error(st.session_state["_yours_error"], icon=":material/error:")
        if written:
            path, text = written
            st.success(f"Wrote `{path}` and opened it (sidebar: other path).", icon=":material/check_circle:")
            st.code(text, language="yaml")
            st.download_button("zoo.yaml", text, Path(path).name, "application/yaml", key="yours_dl", on_click="ignore")
