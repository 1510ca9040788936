"""Container Device Interface specs for the devices the agent prepares."""
