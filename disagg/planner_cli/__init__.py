"""`disagg simulate | plan`: the planner's command line, apart from the planner itself so that
the planner stays pure (the command line uses the bench's workloads, which need numpy) and the
server can run the planner inside (the re-planning loop)."""
