"""Kubernetes attribution: which pod, namespace and container a pid belongs to.

``cgroup`` reads a container id out of /proc/PID/cgroup (v1 and v2, every common
runtime and cgroup driver); ``apiserver`` lists this node's pods through the
Kubernetes API with the standard library; ``attribution`` puts them together
behind the ``Attributor`` protocol (sidecar mode from the Downward API
environment, DaemonSet mode from cgroups + the API, with caching).
"""
