"""Everything that runs ON A NODE, as root: the node helper and the weights fetcher
(standard library only; the control host ships their sources, it does not import them
there)."""
