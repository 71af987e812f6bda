"""Ray Serve replicas behind one front: the deployment, the router, the front's engine client and its
metrics."""
