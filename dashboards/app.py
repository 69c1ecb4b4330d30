"""perfmodel dashboard: `streamlit run dashboards/app.py` (bundled data only; no GPU, TPU or network).

Views: Compare (predicted vs measured tokens/s), What-if (prefetch / VMEM / batch tuning),
Validation (per-layer predicted vs measured traces), Models & hardware (presets and uploads).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import streamlit as st  # noqa: E402

st.set_page_config(page_title="perfmodel: decode performance", layout="wide")

from pmdash import common, compare, models, validation, whatif  # noqa: E402

VIEWS = {"Compare": compare.render, "What-if": whatif.render, "Validation": validation.render,
         "Models & hardware": models.render}
from pmdash import design  # noqa: E402
VIEWS["Design search"] = design.render

# Streamlit forgets the state of widgets that a run does not draw: keep each view's inputs when
# another view is shown (re-assigning a widget's value marks it as user state).
for key in [k for k in st.session_state if isinstance(k, str) and k.startswith(common.VIEW_PREFIXES)]:
    if key not in common.NOT_SETTABLE and not key.endswith(("_csv", "_json")):
        st.session_state[key] = st.session_state[key]

st.sidebar.title("perfmodel")
view = st.sidebar.radio("View", list(VIEWS), key="view")
st.sidebar.caption("Decode performance model of LLMs on TPU v7, GB200 and other chips. "
                   "Every number can be downloaded and reproduced with the `perfmodel` CLI.")
common.guarded(VIEWS[view])
