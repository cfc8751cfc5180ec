"""Expert offloading: budget, slot caches, copies, CPU experts, and the planner that drives them."""
