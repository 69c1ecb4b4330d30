"""The perfmodel Streamlit dashboard's views and helpers (entry point: dashboards/app.py)."""
