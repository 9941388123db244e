"""The names of the series an audit adds to its run, beside the trainer's own metrics (stored per audited
step): the audit writes them, the health rules read them."""

COV_SERIES = "rlvitals/entropy_cov"
FORECAST_SERIES = "rlvitals/entropy_forecast"
ETA_SERIES = "rlvitals/entropy_eta"
ZERO_ADV_SERIES = "rlvitals/zero_adv_share"
