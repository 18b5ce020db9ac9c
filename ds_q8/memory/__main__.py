"""``python -m ds_q8.memory``: the predicted memory tables (``predict.main``)."""
from .predict import main

raise SystemExit(main())
