"""Cascade tree attention kernels."""
