"""The trained post-merging calibrators: task-specific modules added to a merged model and
trained toward each expert (ESCal, Surgery, SurgeryV2)."""
