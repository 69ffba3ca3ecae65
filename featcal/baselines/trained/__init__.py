"""Trained post-merging calibrators (ESCal, Surgery, SurgeryV2): their modules, their training loop,
and the functions that add and train them."""
