"""NVIDIA Dynamo's router index as a KV-event consumer (optional: pip install kvpool[dynamo])."""
