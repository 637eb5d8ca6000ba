"""What every worker actor shares: the actor base (engine thread, request link, heartbeat) and rank 0's handle on the other ranks of its instance."""
