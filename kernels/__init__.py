"""Specialized paths and their stock baselines, one package per problem."""
