"""Distributed serving: tensor-parallel groups and their collectives (shared memory or gloo/NCCL), and
Ray Serve replicas behind one front (ray/)."""
