"""Running a compiled graph: the plan (steps, slots, memory), the step loop, the heap, and
the finiteness guard of oneDNN calls."""
