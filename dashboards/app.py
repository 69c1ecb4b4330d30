"""perfmodel dashboard: `streamlit run dashboards/app.py` (bundled data only; no GPU, TPU or network).

Views: Compare (predicted vs measured tokens/s), What-if (prefetch / expert slots / VMEM / batch
tuning), Explain (the step layer by layer and one layer op by op), Design search (a swept design's
Pareto front), Validation (per-layer predicted vs measured traces), Models & hardware (presets and
uploads). Settings (localhost only, no usage statistics, no Deploy button) are in
dashboards/.streamlit/config.toml.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import streamlit as st  # noqa: E402

st.set_page_config(page_title="perfmodel: decode performance", layout="wide")

from pmdash import common, compare, design, explain, models, validation, whatif  # noqa: E402

VIEWS = {"Compare": compare.render, "What-if": whatif.render, "Explain": explain.render,
         "Design search": design.render,
         "Validation": validation.render, "Models & hardware": models.render}

common.keep_inputs()
st.sidebar.title("perfmodel")
view = st.sidebar.radio("View", list(VIEWS), key="view", bind="query-params")  # ?view=What-if opens it
st.sidebar.caption("Decode performance model of LLMs on TPU v7, GB200 and other chips. "
                   "Every number can be downloaded and reproduced with the `perfmodel` CLI.")
common.wait_for_loops()
common.guarded(VIEWS[view])
