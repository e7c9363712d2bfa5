"""Running data through a model for statistics: in one process, layer by layer under a weight budget
(segments), or on Ray workers (distributed); batch sizing; statistics computed in the graph."""
