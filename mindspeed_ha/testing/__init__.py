"""Test helpers shipped with mindspeed-ha: run the trainer (harness), inject faults (injector)."""
