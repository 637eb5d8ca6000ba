"""Facts of the host the figures are measured on: CPU compute and bandwidth, how engines share its cores."""
