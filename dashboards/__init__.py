"""The Streamlit dashboard (`perfmodel dashboard`, or `streamlit run dashboards/app.py`)."""
