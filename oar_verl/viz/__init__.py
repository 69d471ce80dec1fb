"""Token heatmaps (``python -m oar_verl.viz.heatmap``) and metric curves (``python -m oar_verl.viz.curves``)."""
