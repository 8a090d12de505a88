from django.apps import AppConfig


class TaskappConfig(AppConfig):
    name = "tests_django.taskapp"
