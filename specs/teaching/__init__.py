"""Teaching the semantics: scenarios told step by step, and pictures drawn from the model.

* ``scenarios``: named scenarios (and any vector) as steps with their outcomes;
* ``explain``: ``kvpool explain``, a scenario in a terminal or as HTML;
* ``pictures`` and ``v0_pictures``: SVG pictures of a pool's state, for the docs.
"""
