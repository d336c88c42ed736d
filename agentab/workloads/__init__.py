"""agentab.workloads"""
