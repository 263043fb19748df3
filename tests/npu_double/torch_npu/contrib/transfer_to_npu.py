"""``torch_npu.contrib.transfer_to_npu``: on a real NPU it maps ``cuda`` calls to ``npu``;
on the CPU double there is nothing to map (mindspeed-ha's CPU backend maps them to CPU)."""
