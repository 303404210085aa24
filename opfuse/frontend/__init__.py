"""Model -> Graph: torch.export and dynamo capture, decompositions, BatchNorm folding on
modules, the parameter watch, and replaying a graph with torch."""
