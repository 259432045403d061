"""A fleet of engine replicas: data-parallel launch, the prefix-aware router and its policy."""
