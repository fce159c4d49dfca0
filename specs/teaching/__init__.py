"""Teaching the semantics: scenarios told step by step, and pictures drawn from the model.

* ``command``: ``kvpool explain``, a scenario of either layer in a terminal or as HTML;
* the block pool: ``scenarios`` (built-in stories and any vector), ``explain``
  (terminal and HTML), ``pictures`` (SVG of a pool's state);
* the request layer: ``request_scenarios`` (stories as data, and their file
  format), ``request_stories`` (the built-in ones), ``request_facts`` (what a
  step did: hash chain, lookup, admission, release), ``request_pictures``,
  ``request_figures`` (named figures for the docs) and ``request_explain``;
* ``texts``: the plain-text worked examples the docs commit, generated from the model;
* ``v0_pictures``: the v0 allocator's pictures and its story beside v1.
"""
