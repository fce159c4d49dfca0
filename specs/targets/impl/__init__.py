"""kvpool's own fast implementation (``kvpool.impl``) as a target of each layer it implements."""
