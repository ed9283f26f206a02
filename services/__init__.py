"""The six hetsched services, one package each (`python -m services.<name>`); `registry` lists them."""
