"""Facts of the machine a process runs on: the address it listens on, the CPUs its threads use."""
